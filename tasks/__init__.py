"""One Prefect task per stage: cache policy, retries and artifacts around one eagle3/ call."""
