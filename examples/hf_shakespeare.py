"""A Hugging Face GPT-2 trained by ExoGym as it comes: DDP vs DiLoCo on 4 nodes, character-level Shakespeare.

    pip install 'exogym[hf]'               # transformers and datasets
    python examples/hf_shakespeare.py      # a few minutes on a 2-core CPU
    python examples/hf_shakespeare.py --steps 40
    python examples/hf_shakespeare.py --update-docs   # the default run, its JSON into docs/img

Nothing is downloaded from the Hugging Face hub: the model is a `GPT2LMHeadModel` built from a small
`GPT2Config`, and the tokens are the characters of the bundled Shakespeare text (exogym.data.shakespeare),
held in a `datasets.Dataset` of blocks with "input_ids" and "labels" columns. The Trainer passes each
batch's columns to the model as keywords, `model(input_ids=..., labels=...)`, and trains on the `.loss`
of the output it returns, exactly as for any other model (see the model contract in README.md).
The numbers go to runs/hf_shakespeare.json (git-ignored; --out to move it, --update-docs to write
docs/img/hf_shakespeare.json, with the default settings only).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from exogym import Trainer
from exogym.data.shakespeare import VAL_FRACTION, CharVocab, shakespeare_text
from exogym.strategy import DiLoCoStrategy, OptimSpec, SimpleReduceStrategy
from published_output import add_update_docs, output_path, print_outputs

NODES = 4


def char_blocks(ids: torch.Tensor, block_size: int):
    """A datasets.Dataset of non-overlapping blocks: input_ids [block_size] and the same as labels
    (GPT2LMHeadModel shifts the labels itself, so position t is scored on the character after it)."""
    from datasets import Dataset

    blocks = ids[: len(ids) // block_size * block_size].view(-1, block_size).numpy()  # [N, block_size]
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks}).with_format("torch")


def gpt2(vocab_size: int, block_size: int, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=None, eos_token_id=None, use_cache=False)
    torch.manual_seed(seed)  # every run starts from the same weights
    return GPT2LMHeadModel(config)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, data, batches: int = 10, batch_size: int = 32) -> float:
    """Mean loss over the first batches x batch_size validation blocks (the same blocks for every run)."""
    model.eval()
    losses = [model(**data[i * batch_size:(i + 1) * batch_size]).loss.item() for i in range(batches)]
    return sum(losses) / len(losses)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with args.out resolved to the JSON file's path (see published_output.output_path)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    parser.add_argument("--block-size", type=int, default=32, help="characters per block (default 32)")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks per node per step (default 8)")
    parser.add_argument("--H", type=int, default=10, help="DiLoCo: inner steps per round (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="the JSON file of the numbers (default runs/hf_shakespeare.json)")
    add_update_docs(parser, "hf_shakespeare.json")
    args = parser.parse_args(argv)
    args.out = output_path(parser, args, "hf_shakespeare.json", given=args.out)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    text = shakespeare_text()
    vocab = CharVocab.from_text(text)
    ids = vocab.encode(text)
    split = int(len(ids) * (1 - VAL_FRACTION))
    train, val = char_blocks(ids[:split], args.block_size), char_blocks(ids[split:], args.block_size)
    print(f"Shakespeare: {len(text):,} characters, a vocabulary of {vocab.size}; {len(train):,} training and "
          f"{len(val):,} validation blocks of {args.block_size} in a datasets.Dataset\n", flush=True)

    adamw = OptimSpec(torch.optim.AdamW, lr=3e-3, weight_decay=0.0)
    runs = [("DDP", SimpleReduceStrategy(adamw, max_norm=1.0)),
            (f"DiLoCo H={args.H}", DiLoCoStrategy(adamw, H=args.H, max_norm=1.0))]
    rows = []
    for label, strategy in runs:
        trainer = Trainer(gpt2(vocab.size, args.block_size, args.seed), train, val)
        start = time.perf_counter()
        model = trainer.fit(strategy, NODES, max_steps=args.steps, batch_size=args.batch_size, val_size=128,
                            val_interval=max(1, args.steps // 3), seed=args.seed, device="cpu", logger=False)
        seconds = time.perf_counter() - start
        loss = held_out_loss(model, val)
        rows.append((label, loss, trainer.record.bytes_per_node[0], seconds))
        print(f"{label:<12} held-out loss {loss:.4f}  sent/node {rows[-1][2] / 1e6:8.2f} MB  {seconds:6.1f} s\n",
              flush=True)

    ddp_bytes = rows[0][2]
    print("| run | nodes | held-out loss | MB sent per node | vs DDP | seconds |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, loss, sent, seconds in rows:
        print(f"| {label} | {NODES} | {loss:.4f} | {sent / 1e6:.2f} | {sent / ddp_bytes:.3f} | {seconds:.1f} |")
    args.out.write_text(json.dumps({
        "command": "python examples/hf_shakespeare.py" + (" --update-docs" if args.update_docs else ""),
        "steps": args.steps, "block_size": args.block_size,
        "batch_size": args.batch_size, "H": args.H, "seed": args.seed, "nodes": NODES,
        "runs": [{"label": label, "held_out_loss": loss, "wire_bytes_per_node": sent, "seconds": round(sec, 1)}
                 for label, loss, sent, sec in rows]}, indent=1) + "\n")
    print_outputs([args.out])


if __name__ == "__main__":
    main()
