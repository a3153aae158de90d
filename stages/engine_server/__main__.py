"""`python -m unirl.stages.engine_server --spec FILE` (or a recipe): see stages/engine_server/__init__.py."""
import sys

from unirl.stages.engine_server import main

sys.exit(main())
