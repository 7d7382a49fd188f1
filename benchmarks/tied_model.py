"""A tiny causal GPT whose output head reuses its embedding table, trained by jaxstream and by
plain nnx + optax from the same initialisation: parameter counts and how far apart the two
trainings end (the tie is one parameter in both, so the goal is agreement to float precision).
With plain SGD the difference is the gradients' float noise; with Adam, leaves whose exact
gradient is zero (the attention key bias: softmax ignores it) get noise-over-noise updates of
about the learning rate, so Adam's figure is given for the tied table.

Usage:
  python benchmarks/tied_model.py [--steps 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxstream as js

VOCAB, D, T, HEADS = 32, 16, 8, 2


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP, residual."""

    def __init__(self, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, h):
        mask = nnx.make_causal_mask(jnp.ones(h.shape[:2]))
        h = h + self.attn(self.ln1(h), mask=mask)
        return h + self.fc2(nnx.gelu(self.fc1(self.ln2(h))))


class TiedHead(nnx.Module):
    """Next-token logits of the last position from the embedding table."""

    def __init__(self, embed: nnx.Embed):
        self.embed = embed

    def __call__(self, h):
        return self.embed.attend(h[:, -1])


def gpt(seed: int) -> nnx.Sequential:
    rngs = nnx.Rngs(seed)
    emb = nnx.Embed(VOCAB, D, rngs=rngs)
    return nnx.Sequential(emb, Block(rngs), Block(rngs), nnx.LayerNorm(D, rngs=rngs),
                          TiedHead(emb))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    batches = [{"x": jnp.asarray(rng.integers(0, VOCAB, (16, T)), jnp.int32),
                "y": jnp.asarray(rng.integers(0, VOCAB, (16,)), jnp.int32)}
               for _ in range(args.steps)]

    count = lambda tree: int(sum(np.size(x) for x in jax.tree.leaves(tree)))
    result: dict = {"steps": args.steps}
    for name, tx in (("sgd", optax.sgd(0.1)), ("adam", optax.adam(3e-3))):
        plain = gpt(0)
        opt = nnx.Optimizer(plain, tx, wrt=nnx.Param)

        @nnx.jit
        def plain_step(m, o, b):
            loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(
                m(b["x"]), b["y"]).mean()
            o.update(m, nnx.grad(loss)(m))

        model = js.models.from_sequential(gpt(0), loss="cross_entropy")
        params = model.init(None)
        step = js.train_step(js.grad.backprop(), tx, model)
        opt_state = step.init(params)
        start = np.asarray(params[0]["embedding"])
        for i, b in enumerate(batches):
            plain_step(plain, opt, b)
            params, opt_state, _ = step(params, opt_state, b, jax.random.key(i))
        trained = model.to_nnx(params)
        pairs = list(zip(jax.tree.leaves(nnx.state(trained, nnx.Param)),
                         jax.tree.leaves(nnx.state(plain, nnx.Param))))
        table = np.abs(np.asarray(trained.layers[0].embedding[...])
                       - np.asarray(plain.layers[0].embedding[...]))
        result[name] = {
            "params_jaxstream": count(params),
            "params_plain_nnx": count(nnx.state(plain, nnx.Param)),
            "params_if_untied": count(nnx.state(plain, nnx.Param)) + VOCAB * D,
            "head_table_is_embedding": trained.layers[4].embed.embedding is trained.layers[0].embedding,
            "max_abs_diff_all_leaves": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                                           for a, b in pairs),
            "max_abs_diff_tied_table": float(table.max()),
            "tied_table_moved_by": float(np.max(np.abs(np.asarray(params[0]["embedding"]) - start))),
        }
    for name in ("sgd", "adam"):
        for k, v in result[name].items():
            print(f"{name:5s} {k:26s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
