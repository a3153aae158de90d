"""The torchrun worker group: `group` (client), `policy` (per rank), `control` (channel)."""
