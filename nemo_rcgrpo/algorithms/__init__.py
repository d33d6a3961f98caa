"""Algorithms: pure loss math and the training loops (stage 1 SFT/RCTP-FT; stage 2 GRPO/RC-GRPO)."""
