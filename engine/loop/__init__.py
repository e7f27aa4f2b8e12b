"""The engine loops: ``LLMEngine`` (schedule, execute, update, outputs) and the front ends
that drive it: the offline ``LLM``, the server's engine thread (``AsyncEngine``) and the
data-parallel engine with its replica processes; ``EngineInfo``, what a front end may know."""
