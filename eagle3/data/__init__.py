"""Stage 1 (prepare): conversation readers, chat-template rendering + loss mask, vocab map, Parquet."""
