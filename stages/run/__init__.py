"""The run: one iteration's stages (iteration.py), held-out evaluation, on-policy distillation's
advantages, the async producer, the run record (record.py: run.json, the initial weights), MLflow
tracking and `unirl audit`; above the models, policies, engines and workers it drives, below the
Prefect tasks and flows (docs/architecture.md, "Layers")."""
