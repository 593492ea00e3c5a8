"""Host-side pieces every layer may use: the name registry, the config error, padding prompt
batches and reading numeric answers. Pure Python and numpy: they import nothing else of the
project, and no JAX."""
