"""The decision record: built, written, logged, printed, shown on the progress bar."""
