"""Rewinding trials: the search's hold on Lightning's fit loop (bit-exact snapshots, callbacks paused for a while,
the loop budget and cut epochs). Each module's docstring says what it holds.
"""
