"""Token corpora: Megatron-LM's indexed format (read, ranged reads, write), token windows and
documents over it, tokenizers, and SFT samples from chat data."""
