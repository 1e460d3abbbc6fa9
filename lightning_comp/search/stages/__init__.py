"""The stages of the search: the batch stage (measuring) and the epoch stage (convergence trials).

================  ===========================================================================================
module            what it runs
================  ===========================================================================================
``batch_result``  what the batch stage hands the epoch stage, and what the record keeps of it
``saved_stage``   the saved precision of each operator (memory and balanced objectives)
``batch_stage``   per-operator and whole-step measurements on one batch; the candidates
``trials``        the convergence trials, their verdicts, the end of the search
================  ===========================================================================================
"""
