"""One RL step and the loop around it: the device functions (`step`), their update,
log-prob and packing passes, the step's data types, the trainer and its parts,
many runs in one program, checkpoints and validation."""
