"""A request body read into engine inputs: checked field by field, every refusal a 400.

protocol.py turns a body into SamplingParams and the answer's options;
fields.py decides what happens to a field not served (refused or ignored);
structured.py reads the structured-output fields, tools.py the tool fields,
reasoning.py a reasoning model's split, grammar_limits.py how large a
constraint may be. Plain checks on plain data: nothing here tokenizes, holds
server state or talks to the engine (that is generation/).
"""
