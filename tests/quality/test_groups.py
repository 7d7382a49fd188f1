"""Layer groups of a params pytree: which entries are groups."""


def test_parameter_free_layers_are_no_group():
    """An nnx Sequential's activations hold no parameters: they are not listed as groups
    (rows of zeros before), and the sums and sizes agree with the names."""
    import jax.numpy as jnp

    from jaxstream.quality.groups import group_names, group_sums, num_parameters

    params = ({"kernel": jnp.ones((2, 3))}, {}, {"kernel": 2 * jnp.ones((3, 1))}, {})
    assert group_names(params) == ["0", "2", "all"]
    sums = group_sums(lambda x, y: x * y, params, params)
    assert set(sums) == {"0", "2", "all"} and float(sums["2"]) == 12.0
    assert num_parameters(params) == {"0": 6, "2": 3, "all": 9}
    assert group_names({"w": jnp.ones(2), "act": {}}) == ["w", "all"]
