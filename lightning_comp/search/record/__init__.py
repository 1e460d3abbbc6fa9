"""The decision record: what the search measured, tried and chose, and what it cost; built, written as JSON, printed,
sent to the loggers and shown on the progress bar. Each module's docstring says what it does with the record.
"""
