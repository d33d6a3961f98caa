"""Model and tokenizer loading."""
