"""Run plumbing: storage and leases, the run record, shards and their columns, the data plane's
media, evaluation, tracking, faults, secrets, start-up, and the registry the seams use."""
