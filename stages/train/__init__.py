"""Training, whatever the family, policy or algorithm: the train stack (stages/train/stack.py),
the RL update and the SFT loop over it (stages/train/update.py), checkpoints and publication
(stages/train/checkpoint.py)."""
