"""verl's algorithm math as pure functions: advantage estimators, policy and value
losses, KL control, masked reductions and rollout correction."""
