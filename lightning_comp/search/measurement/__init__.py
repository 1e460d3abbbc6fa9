"""What the batch stage measures with: clocks, the machine's load, profilers, ratio estimates.

==================  =====================================================================================
module              what it holds
==================  =====================================================================================
``clocks``          wall time, CUDA events, the measuring thread's CPU time
``machine_load``    the CPU time other processes take on this process's CPUs
``clock_choice``    which clock a batch stage measures with, and why (the answer to a busy machine)
``estimates``       the ratio of two configurations from paired rounds, with its confidence interval
``step_runner``     one of the user's training steps on one batch
``profiling``       per-operator time and saved bytes of a training step, per configuration
``step_timing``     whole steps of several configurations timed side by side; the bytes a step saves
``extra_rounds``    the budget of extra rounds when the first ones cannot decide
==================  =====================================================================================
"""
