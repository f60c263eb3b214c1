"""Conversation data, shared by prepare and regenerate: readers of every source format (readers),
normalization rules (normalize), chat-template rendering with the loss mask (template), and the draft
vocabulary map (vocab)."""
