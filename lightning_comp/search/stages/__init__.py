"""The stages of the search: the batch stage (measuring) and the epoch stage (convergence trials)."""
