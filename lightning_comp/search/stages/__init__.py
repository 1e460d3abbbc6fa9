"""The stages of the search: the batch stage (measuring on one batch, per dimension) and the epoch stage (convergence
trials). Each module's docstring says what it runs.
"""
