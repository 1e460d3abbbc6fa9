"""The decision record: what the search measured, tried and chose, and what it cost.

============  ===============================================================================================
module        what it does with the record
============  ===============================================================================================
``progress``  shows the batch stage's rounds and the running trial on Lightning's progress bar
``text``      prints it as tables
``loggers``   sends it to every attached logger in that logger's form
``build``     builds it from the search's state, writes it as JSON, logs and prints it
============  ===============================================================================================
"""
