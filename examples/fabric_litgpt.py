"""litgpt's own GPT trained in a Lightning Fabric loop under a CoMP precision plan (needs the [litgpt] extra).

    python examples/fabric_litgpt.py                      # an all-bf16 plan, the head kept fp32
    python examples/fabric_litgpt.py --plan outputs/.../plan.json   # a plan a Trainer search saved

Trains a tiny LLaMA-style GPT on Python's own documentation text (nothing is downloaded), saves a Fabric checkpoint
with the plan in it, loads it into a fresh plugin and prints the plan in force.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import litgpt
import torch
from lightning.fabric import Fabric

from lightning_comp import CoMPFabricPrecision
from lightning_comp.zoo import load_corpus


def tiny_gpt() -> litgpt.GPT:
    config = litgpt.Config(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, vocab_size=256, padded_vocab_size=256,
                           block_size=64, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                           intermediate_size=128, rotary_percentage=1.0, parallel_residual=False)
    return litgpt.GPT(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default=None, help="a plan file (default: all bf16, lm_head fp32)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="fabric_litgpt", help="folder of the checkpoint")
    args = parser.parse_args()
    torch.manual_seed(0)
    plugin = CoMPFabricPrecision(args.plan or {"*": "bf16", "lm_head": "fp32"})
    fabric = Fabric(accelerator="auto", devices=1, plugins=[plugin])
    model = fabric.setup_module(tiny_gpt())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    data = torch.tensor(list(load_corpus()), dtype=torch.long)  # bytes
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - 65, (16,))
        batch = torch.stack([data[s:s + 65] for s in starts]).to(fabric.device)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            fabric.print(f"step {step:3d}  loss {loss.item():.3f}")
    path = Path(args.out) / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "comp": plugin})
    restored = CoMPFabricPrecision()
    fabric2 = Fabric(accelerator="auto", devices=1, plugins=[restored])
    model2 = fabric2.setup_module(tiny_gpt())
    fabric2.load(path, {"model": model2, "comp": restored})
    fabric.print(restored.plan.summary(model2))


if __name__ == "__main__":
    main()
