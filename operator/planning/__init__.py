"""Planning, pure: GPU and model catalogs, the serving maths (sizing) and the planner that turns a spec
into a Plan. Depends only on api/ and the engine's contract (kvpilot.engine.config)."""
