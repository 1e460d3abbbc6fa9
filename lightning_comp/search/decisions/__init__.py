"""Decisions of the search, made from measurements and trial verdicts (no Trainer needed to test them).

================  =========================================================================================
module            what it decides
================  =========================================================================================
``whole_step``    :class:`StepComparison`: whole-step times of several plans, compared two by two
``objectives``    one policy per objective: verdicts, scores, ranking and wording
``saved``         each operator's saved precision, judged per group of operators that save the same tensors
``operators``     each operator's compute decision: candidate, fill or FP32
``trial_plans``   the plan of a trial: a group of candidates plus the cheap operators between them
``group_search``  adaptive group testing over the candidates
``trials``        a trial's verdict against the FP32 reference
================  =========================================================================================
"""
