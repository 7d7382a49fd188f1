"""Creating a layer store's arrays and first commit, and the pytree structures of an open one."""

from __future__ import annotations

import re
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
    opt_init, per_layer = initial_states(optimizer, templates, params["blocks"], num_layers)
    manifest = {
        "format": FORMAT, "step": int(step), "generation": 0, "num_layers": num_layers,
        "model_config": dict(model_config or {}),
        "leaves": {"params": {p: leaf_table(templates[p]) for p in PARTS},
                   "opt": {p: leaf_table(opt_init[p]) for p in PARTS}},
        "slots": {"embed": 0, "head": 0, "blocks": [0] * num_layers},
        "extra": {},
        "digests": initial_digests(params, opt_init, num_layers, per_layer),
    }
    if optimizer is not None:  # which optimizer's state: two can share leaf names
        manifest["opt_structure"] = {p: state_structure(opt_init[p]) for p in PARTS}
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
    stacked = jax.tree_util.tree_leaves(per_layer) if per_layer is not None else None
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
                    futs.append(arr[:, 0].write(stacked[i] if stacked is not None else
                                                np.broadcast_to(leaf, (num_layers,)
                                                                + np.shape(leaf))))
                else:
                    futs.append(arr[0].write(leaf))
    for f in futs:
        f.result()
    write_manifest(root, manifest, str(location))


def initial_states(optimizer: Any, templates: dict, blocks: Any, num_layers: int
                   ) -> tuple[dict, Any]:
    """``(state of each unit template, per-layer block states or None)``: one initial block
    state for every layer, unless it depends on the parameters' values (as schedule-free's z
    does); then each layer's own, stacked (L, ...)."""
    opt_init = {p: (optimizer.init(templates[p]) if optimizer is not None else ()) for p in PARTS}
    opt_init = jax.tree.map(np.asarray, opt_init)
    if optimizer is None or not reads_values(optimizer, templates["blocks"]):
        return opt_init, None
    return opt_init, jax.tree.map(lambda *xs: np.stack(xs), *[
        jax.tree.map(np.asarray, optimizer.init(jax.tree.map(lambda x, l=l: x[l], blocks)))
        for l in range(num_layers)])


def check_optimizer(params: dict, optimizer: Any) -> None:
    """Before anything is written: ``optimizer.init`` runs on each unit's parameters alone
    (the embed, one block layer, the head: the store keeps its state per unit), its state holds
    no PRNG key (a store keeps numbers per layer), and a store allocated from shapes is not
    given an optimizer whose initial state reads the parameters' values. ValueError naming
    what is wrong otherwise."""
    if optimizer is None:
        return
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(params))
    units = {"embed": params["embed"], "head": params["head"],
             "blocks": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
                                    if abstract else np.asarray(x)[0], params["blocks"])}
    for part, tree in units.items():
        try:
            state = jax.eval_shape(optimizer.init, tree)
        except Exception as e:
            raise ValueError(
                f"LayerStore.create: the optimizer cannot be initialised on the {part}'s "
                f"parameters alone ({type(e).__name__}: {str(e).splitlines()[0][:200]}); the "
                f"store keeps its state per unit (the embed, each block layer, the head), so a "
                f"mask or a per-parameter setting must be a callable or fit one unit") from e
        keys = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_leaves_with_path(state)
                if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
        if keys:
            raise ValueError(
                f"LayerStore.create: the optimizer keeps a PRNG key in its state ({keys[0]}: "
                f"noisy_sgd and kin); a layer store keeps arrays of numbers per layer, and one "
                f"key per layer would draw other noise than in memory: use an optimizer "
                f"without random state")
    if abstract and reads_values(optimizer, jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                                                         units["blocks"])):
        raise ValueError(
            "LayerStore.create: the optimizer's initial state depends on the parameters' "
            "values (optimizer.init(params) differs for other values), and a store allocated "
            "from shapes (jax.ShapeDtypeStruct) has none yet; create it from the parameters "
            "themselves")


def reads_values(optimizer: Any, layer: Any) -> bool:
    """Whether ``optimizer.init`` of one layer depends on the parameters' values (compared at
    the layer's values and at their double plus one), not only on their shapes."""
    a = optimizer.init(layer)
    b = optimizer.init(jax.tree.map(lambda x: np.asarray(x) * 2 + 1, layer))
    return not all(np.array_equal(_plain(x), _plain(y))
                   for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _plain(x: Any) -> np.ndarray:
    """A state leaf as NumPy (a PRNG key by its data)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def initial_digests(params: dict, opt_init: dict, num_layers: int,
                    per_layer: Any = None) -> dict:
    """The crc32c of every chunk of slot 0 as :func:`write_new_store` writes it (abstract
    block parameters: zeros; optimizer blocks: the one initial state in every layer, or each
    layer's own where ``per_layer`` stacks them)."""
    def leaves(tree):
        return jax.tree_util.tree_leaves(tree)

    def block_rows(tree, per_layer):
        return [[digest(per_layer(x, l)) for x in leaves(tree)] for l in range(num_layers)]

    out = {}
    for kind, trees in (("params", params), ("opt", opt_init)):
        out[kind] = {p: [digest(x) for x in leaves(trees[p])] for p in ("embed", "head")}
        if kind == "opt" and per_layer is not None:
            out[kind]["blocks"] = block_rows(per_layer, lambda x, l: x[l])
        elif kind == "opt":
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
                if a["name"] != b["name"]:  # same shapes, other names: weights in other places
                    raise StoreMismatchError(
                        f"store at {location} holds another model: {part} leaf {a['name']!r} "
                        f"is {b['name']!r} in the model (leaves in order: "
                        f"{[e['name'] for e in table]} vs {[e['name'] for e in found]})")
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
            kept = [e["name"] for e in m["leaves"]["opt"][part]]  # (shapes: checked against
            mine = [e["name"] for e in leaf_table(st)]               # the arrays on read)
            if kept != mine:  # another optimizer (sgd on adam's state: trained with sgd,
                raise StoreMismatchError(  # adam's state left behind)
                    f"store at {location} keeps the state of another optimizer: {part}'s is "
                    f"{_few(kept)}, this optimizer's {_few(mine)}; use the optimizer the store "
                    f"was created with")
            made = m.get("opt_structure", {}).get(part)  # (None: a store from before it)
            if made is not None and made != state_structure(st):  # adam's state for adabelief,
                raise StoreMismatchError(  # adam's chain for adamw's: same leaf names
                    f"store at {location} keeps the state of another optimizer: {part}'s is "
                    f"{_types(made)}, this optimizer's {_types(state_structure(st))}; use the "
                    f"optimizer the store was created with")
            opt_treedefs[part] = jax.tree_util.tree_structure(st)
    return treedefs, opt_treedefs


def state_structure(state: Any) -> str:
    """An optimizer state's structure as text: its node types (``ScaleByAdamState``,
    ``ScaleByBeliefState``, a chain's entries) and keys, which tell apart optimizers whose
    state leaves have the same names."""
    return str(jax.tree_util.tree_structure(state))


def _types(structure: str) -> str:
    """The state types named in a :func:`state_structure` text."""
    names = re.findall(r"namedtuple\[(\w+)\]", structure) or [
        n for n in re.findall(r"([A-Za-z_]\w*)(?=[\[(])", structure)
        if n not in ("PyTreeDef", "CustomNode")]
    return "(" + ", ".join(names) + ")" if names else structure


def _few(leaves: list) -> str:
    """A state's leaves as a short text: the count and the first few names."""
    names = list(leaves)
    return f"{len(names)} leaves {names[:4]}" + (" ..." if len(names) > 4 else "")
