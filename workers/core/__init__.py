"""The engine core: `Engine` and `LLM`, requests and their cursors, the scheduler, the step
plan it emits, sampling parameters, outputs, structured-output grammars, the tokenizer and
chat template, and `EngineConfig`."""
