"""What knows no run: state, variables, patches, frames, warnings, errors, the torch compatibility
layer and the detection of the environment. Imports nothing from ``launch/`` or ``in_rank/``."""
