"""unirl: one RL post-training loop for language, vision-language and flow-matching models.

The repository keeps its three parts at its top (flows/, tasks/, stages/); they install as
`unirl.flows` (the Prefect flows and the `unirl` command), `unirl.tasks` (the Prefect tasks of
an iteration) and `unirl.stages` (everything the tasks call). See setup.py.
"""
