"""Host-side pieces that the host layers (data, rewards, envs) share: padding prompt batches
and reading numeric answers. They import nothing of the project."""
