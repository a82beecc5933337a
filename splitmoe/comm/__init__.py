"""Communication between ranks.

`Topology` says who is who; `transport` moves tokens from attention ranks to expert ranks and
partial sums back (dispatch / combine); `control` is the small per-step all-gather that keeps all
ranks in lockstep; `distributed` sets up the process groups.
"""
