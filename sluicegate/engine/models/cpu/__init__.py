"""The CPU's linears: which kernel runs them (``linears``, raced by ``linear_race``), the
kernels' modules (``onednn``, ``packed_linear``), and how many threads each product takes
(``threads``)."""
