"""Creating a layer store's arrays and first commit, and the pytree structures of an open one."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import tensorstore as ts

from jaxstream.stream.errors import StoreMismatchError
from jaxstream.stream.layout import open_array, write_group
from jaxstream.stream.manifest import FORMAT, PARTS
from jaxstream.stream.store_parts import (
    digest,
    leaf_table,
    master_dtype,
    nested_from_names,
    write_manifest,
)

#: The root group's attributes: how to find the current values without jaxstream.
ROOT_ATTRIBUTES = {
    "format": FORMAT,
    "commit_record": "manifest.json",
    "layout": "{params,opt}/{embed,head}/LEAF[slot, ...] and {params,opt}/blocks/LEAF[layer, "
              "slot, ...]; LEAF is the index of the leaf in manifest.json leaves.{params,opt}."
              "{part} (each array's attributes name it)",
    "current_slot": "manifest.json slots.embed, slots.head and slots.blocks[layer] (0 or 1)",
    "step": "manifest.json step",
}


def write_new_store(root: ts.KvStore, ctx: ts.Context, location: Any, params: dict, optimizer: Any,
                    model_config: dict | None, step: int, num_layers: int) -> None:
    """Allocates every array, writes slot 0 of every unit, then the manifest (the commit)."""
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(params))
    if abstract:  # shapes only: allocate, write zeros for the optimizer, leave params to write()
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, master_dtype(x)), params)
        zeros = lambda t: jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), t)
        layer0 = zeros(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                                    params["blocks"]))
        params = {"embed": zeros(params["embed"]), "blocks": params["blocks"],
                  "head": zeros(params["head"])}
    else:
        params = jax.tree.map(lambda x: np.asarray(x, master_dtype(x)), params)
        layer0 = jax.tree.map(lambda x: x[0], params["blocks"])
    templates = {"embed": params["embed"], "blocks": layer0, "head": params["head"]}
    opt_init = {p: (optimizer.init(templates[p]) if optimizer is not None else ()) for p in PARTS}
    opt_init = jax.tree.map(np.asarray, opt_init)
    manifest = {
        "format": FORMAT, "step": int(step), "generation": 0, "num_layers": num_layers,
        "model_config": dict(model_config or {}),
        "leaves": {"params": {p: leaf_table(templates[p]) for p in PARTS},
                   "opt": {p: leaf_table(opt_init[p]) for p in PARTS}},
        "slots": {"embed": 0, "head": 0, "blocks": [0] * num_layers},
        "extra": {},
        "digests": initial_digests(params, opt_init, num_layers),
    }
    write_group(root, "", {"jaxstream": ROOT_ATTRIBUTES})
    for kind, trees in (("params", templates), ("opt", opt_init)):
        write_group(root, kind, {"jaxstream": {"kind": kind}})
        for part in PARTS:
            write_group(root, f"{kind}/{part}", {"jaxstream": {"kind": kind, "part": part}})
            table = manifest["leaves"][kind][part]
            for i, leaf in enumerate(jax.tree_util.tree_leaves(trees[part])):
                shape = tuple(np.shape(leaf))
                lead = (num_layers, 2) if part == "blocks" else (2,)
                dims = ["layer", "slot"] if part == "blocks" else ["slot"]
                attrs = {"jaxstream": {"kind": kind, "part": part, "leaf": table[i]["name"],
                                       "dims": dims + [f"d{k}" for k in range(len(shape))]}}
                open_array(root, f"{kind}/{part}/{i}", ctx, create=True, shape=lead + shape,
                           chunk=(1,) * len(lead) + shape, dtype=str(np.asarray(leaf).dtype),
                           attributes=attrs)
    futs = []
    for kind, trees in (("params", params), ("opt", opt_init)):
        for part in PARTS:
            for i, leaf in enumerate(jax.tree_util.tree_leaves(trees[part])):
                arr = open_array(root, f"{kind}/{part}/{i}", ctx)
                if part == "blocks" and kind == "params":
                    if not abstract:
                        futs.append(arr[:, 0].write(leaf))
                    else:  # zeros, layer by layer: a never-written chunk is an error on read
                        zero = np.zeros(leaf.shape[1:], leaf.dtype)
                        for l in range(num_layers):
                            arr[l, 0].write(zero).result()
                elif part == "blocks":
                    futs.append(arr[:, 0].write(np.broadcast_to(leaf, (num_layers,) + np.shape(leaf))))
                else:
                    futs.append(arr[0].write(leaf))
    for f in futs:
        f.result()
    write_manifest(root, manifest, str(location))


def initial_digests(params: dict, opt_init: dict, num_layers: int) -> dict:
    """The crc32c of every chunk of slot 0 as :func:`write_new_store` writes it (abstract
    block parameters: zeros; optimizer blocks: the one initial state in every layer)."""
    def leaves(tree):
        return jax.tree_util.tree_leaves(tree)

    def block_rows(tree, per_layer):
        return [[digest(per_layer(x, l)) for x in leaves(tree)] for l in range(num_layers)]

    out = {}
    for kind, trees in (("params", params), ("opt", opt_init)):
        out[kind] = {p: [digest(x) for x in leaves(trees[p])] for p in ("embed", "head")}
        if kind == "opt":
            out[kind]["blocks"] = block_rows(trees["blocks"], lambda x, l: x)
        elif any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves(trees["blocks"])):
            out[kind]["blocks"] = block_rows(
                trees["blocks"], lambda x, l: np.zeros(x.shape[1:], x.dtype))
        else:
            out[kind]["blocks"] = block_rows(trees["blocks"], lambda x, l: x[l])
    return out


def tree_structures(m: dict, location: Any, template: dict | None, optimizer: Any) -> tuple[dict, dict]:
    """The params and optimizer-state treedefs of each part; checks ``template`` (when given)
    and ``optimizer`` against the manifest's leaf tables (StoreMismatchError otherwise)."""
    treedefs = {}
    for part in PARTS:
        table = m["leaves"]["params"][part]
        if template is not None:
            t = template[part] if part != "blocks" else jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), template[part])
            found = leaf_table(jax.tree.map(lambda x: np.zeros(x.shape, master_dtype(x)), t))
            for a, b in zip(table, found):
                if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
                    raise StoreMismatchError(
                        f"store at {location} holds another model: {part} leaf {a['name']!r} has "
                        f"shape {a['shape']} {a['dtype']}, the model needs {b['shape']} {b['dtype']}")
            if len(found) != len(table):
                raise StoreMismatchError(f"store at {location} holds another model: {part} has "
                                         f"{len(table)} leaves, the model has {len(found)}")
            treedefs[part] = jax.tree_util.tree_structure(t)
        else:
            names = [e["name"] for e in table]
            treedefs[part] = jax.tree_util.tree_structure(nested_from_names(names, [0] * len(names)))
    if template is not None:
        nl = jax.tree_util.tree_leaves(template["blocks"])[0].shape[0]
        if nl != m["num_layers"]:
            raise StoreMismatchError(f"store at {location} holds another model: num_layers is "
                                     f"{m['num_layers']} in the store, the model has {nl}")
    opt_treedefs = {}
    if optimizer is not None:
        for part in PARTS:
            shapes = [jax.ShapeDtypeStruct(tuple(e["shape"]), np.dtype(e["dtype"]))
                      for e in m["leaves"]["params"][part]]
            t = jax.tree_util.tree_unflatten(treedefs[part], shapes)
            st = jax.eval_shape(optimizer.init, t)
            if len(jax.tree_util.tree_leaves(st)) != len(m["leaves"]["opt"][part]):
                raise StoreMismatchError(f"store at {location}: optimizer state of {part} has "
                                         f"{len(m['leaves']['opt'][part])} leaves, this optimizer has "
                                         f"{len(jax.tree_util.tree_leaves(st))}")
            opt_treedefs[part] = jax.tree_util.tree_structure(st)
    return treedefs, opt_treedefs
