"""Rewinding trials: the search's hold on Lightning's fit loop.

============  ===============================================================================================
module        what it holds
============  ===============================================================================================
``snapshot``  :class:`TrainingSnapshot`: a bit-exact copy of a run's state, restored more than once
``pause``     callbacks (EarlyStopping) taken out of the Trainer for a while, and put back
``loop``      the loop budget (rejected trials given back through ``max_epochs``), cut epochs, rewinds
============  ===============================================================================================
"""
