"""`rcgrpo convert`: HF folder <-> Megatron-Core GPTModel state dicts (one file per tensor-parallel rank).

    rcgrpo convert hf-to-megatron IN OUT --tp N     # IN: HF folder or a model name (smollm2, tiny-qwen2, ...)
    rcgrpo convert megatron-to-hf IN OUT

A Megatron folder holds ``tp_rank_XX.pt`` (the GPTModel state dict of each
rank, local-spec names, vocabulary padded to 128 x tp), ``megatron.json``
(shape, tp, spec, padded vocabulary) and the HF ``config.json``, generation
config and tokenizer files, so that the reverse conversion rebuilds the HF
folder with byte-identical tensors. Pure tensor work: no megatron-core import,
no process group.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

META = "megatron.json"
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "nemo_rcgrpo_training.json",
)  # the training record: how evaluation conditions the model


def _load_hf_tensors(folder: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    out: dict = {}
    if files:
        for f in files:
            out.update(load_file(f))
        return out
    for f in sorted(folder.glob("pytorch_model*.bin")):
        out.update(torch.load(f, map_location="cpu", weights_only=True))
    if not out:
        raise FileNotFoundError(f"{folder} has no *.safetensors or pytorch_model*.bin weights")
    return out


def _fresh_dir(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new output folder")
    out.mkdir(parents=True, exist_ok=True)


def hf_to_megatron_folder(src: str, out: Path, tp: int) -> Path:
    import torch
    from transformers import AutoConfig

    from nemo_rcgrpo.models.hf import resolve_model_path
    from nemo_rcgrpo.models.megatron.convert import ModelShape, hf_to_megatron, padded_vocab_size

    folder = resolve_model_path(src)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(folder, local_files_only=True))
    ranks = hf_to_megatron(_load_hf_tensors(folder), shape, tp)  # checks tp against the heads first
    _fresh_dir(out)
    for r, sd in enumerate(ranks):
        torch.save(sd, out / f"tp_rank_{r:02d}.pt")
    for name in HF_SIDE_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, out / name)
    meta = {
        "format": "megatron-core GPTModel state dicts, one per TP rank",
        "tp": tp,
        "spec": "local",
        "padded_vocab_size": padded_vocab_size(shape.vocab_size, tp),
        "shape": dataclasses.asdict(shape),
        "source": str(folder),
    }
    (out / META).write_text(json.dumps(meta, indent=1))
    return out


def megatron_to_hf_folder(src: Path, out: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from nemo_rcgrpo.models.megatron.convert import ModelShape, megatron_to_hf

    meta_file = src / META
    if not meta_file.is_file():
        raise FileNotFoundError(
            f"{src} is not a Megatron folder written by `rcgrpo convert hf-to-megatron` (no {META})"
        )
    meta = json.loads(meta_file.read_text())
    shape = ModelShape(**meta["shape"])
    ranks = [torch.load(src / f"tp_rank_{r:02d}.pt", map_location="cpu", weights_only=True) for r in range(meta["tp"])]
    hf = {k: v.contiguous() for k, v in megatron_to_hf(ranks, shape, meta.get("spec", "local")).items()}
    _fresh_dir(out)
    save_file(hf, out / "model.safetensors", metadata={"format": "pt"})
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return out


def _run(args: argparse.Namespace) -> int:
    from nemo_rcgrpo.utils.run_command import run_command

    def convert() -> int:  # ConversionError and ModelFilesError: the folders' files, in one line
        if args.direction == "hf-to-megatron":
            path = hf_to_megatron_folder(args.input, Path(args.output), args.tp)
        else:
            path = megatron_to_hf_folder(Path(args.input), Path(args.output))
        print(f"wrote {path}")
        return 0

    return run_command(convert)


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert weights: hf-to-megatron IN OUT --tp N | megatron-to-hf IN OUT")
    p.add_argument("direction", choices=("hf-to-megatron", "megatron-to-hf"))
    p.add_argument("input", help="HF folder or model name (hf-to-megatron), or a Megatron folder (megatron-to-hf)")
    p.add_argument("output", help="new output folder")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (hf-to-megatron)")
    p.set_defaults(func=_run)
