"""What the batch stage measures with: clocks, the machine's load, profilers, ratio estimates, and what one global
autocast region lowers (AMP's plan). Each module's docstring says what it holds.
"""
