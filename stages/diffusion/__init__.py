"""The diffusion (flow-matching) track's stage code: the sampling plan and loop, the stored
trajectory, the per-algorithm losses over a trajectory, the EMA old policy, VAE warm-up and
flow-matching SFT, held-out toy-GenEval evaluation and image grids. Plain torch; the worker
(`stages.workers.diffusion`) owns the models and the process group."""
