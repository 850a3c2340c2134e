"""Acceptance analysis: what speculative decoding can gain, and how well a draft fits a target.

theory    expected τ and speedup for α, k, c (Leviathan et al.), the best k, α per token from counts
costs     this machine's pass costs by width, the draft's per token, the speedup they allow by α
diagnose  teacher-forced draft/target comparison per position, predicted α next to a measured run
charts    the PNG charts (matplotlib, Agg canvas): speedup versus acceptance, agreement along the output
render    the rich tables and coloured text the CLI prints

`theory` imports nothing heavy, so `specdraft theory` starts at once.
"""
