"""What every benchmark imports: ``cli`` (the command line each starts from), ``machine``
(the machine line every result carries), ``servers`` (launching pdserve and peer servers,
free ports), ``processes`` (a process tree's pids, fds, RSS and shared memory), ``sse``
(reading event streams) and ``words`` (the plain words prompts are built from)."""
