"""The MPI transport (mpi4py's buffer API). Placeholder until written."""
