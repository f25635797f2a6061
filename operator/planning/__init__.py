"""Planning, pure: GPU and model catalogs, the serving maths (sizing) and the planner (plan.py, with
memory.py, latency.py and choices.py) that turns a spec into a Plan. Depends only on api/, the
runtimes' declared capabilities (runtimes/) and the engine's torch-free contract."""
