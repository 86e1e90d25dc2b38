"""`specdec validate`: the pre-launch check of speculative decoding on a user's own prompts.

samples.py reads the prompts; measure.py runs acceptance, load and distribution measurements;
analysis.py computes figures, predicted-vs-measured breakdowns and the verdict; settings.py
translates the verdict into other frameworks' flags; report.py writes report.json,
report.html and the terminal summary; pipeline.py runs them in order.
"""
