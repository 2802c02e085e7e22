"""Three AdamW steps of a small ``torch.compile``'d TinyGPT (SDPA attention), as a user's
plain training loop writes them, for ``reprotrain run`` / ``verify -- CMD``.

    python compiled_loop.py OUT_FOLDER [MARCH]

Writes ``OUT_FOLDER/model.safetensors``. ``MARCH`` replaces Inductor's ``-march``
(``torch._inductor.config.cpp.march``) after any profile's pin, to show what it decides.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from reprotrain.determinism import configure_determinism
from reprotrain.recipes.language_model import TinyGPT


def main() -> None:
    out = Path(sys.argv[1])
    if len(sys.argv) > 2:
        import torch._inductor.config as inductor

        inductor.cpp.march = sys.argv[2]
    configure_determinism(0, True)  # the profile `reprotrain run --cpu-profile` launched
    model = TinyGPT(vocab_size=40, block_size=32, n_layer=1, n_head=2, n_embd=32, attention="sdpa")
    model.blocks = torch.compile(model.blocks)  # the way most scripts write it
    optimizer = model.configure_optimizers()
    g = torch.Generator().manual_seed(1)
    model.train()
    for step in range(3):
        tokens = torch.randint(0, 40, (8, 33), generator=g)
        batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        loss = model.training_step(batch, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"))
    print(f"compiled graphs: {torch._dynamo.utils.counters['stats']['unique_graphs']}")


if __name__ == "__main__":
    main()
