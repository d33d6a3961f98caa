"""The training recipes, apart from the parts they are made of (as torchtune keeps its recipes): stage1.py (SFT,
RCTP-FT), rl.py (GRPO, RC-GRPO, DAPO's filter) and run_loop.py (what both do around their steps: resume,
progress, logging, checkpoints, a clean stop, the HF export). The pure parts live in `nemo_rcgrpo/algorithms/`,
the registered entries that run them in `nemo_rcgrpo/loops.py`."""
