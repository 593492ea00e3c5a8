"""Experiment configs: one `get_config()` file per run (`--config experiments/configs/<name>.py`),
the ablation methods under `ablation/`, and the model shapes the planner reads under
`plan_models/`. Programs that run them live one level up (`experiments/*.py`)."""
