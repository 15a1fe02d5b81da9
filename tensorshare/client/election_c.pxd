# The compiled twin election_c is typed by election.pxd (the declarations other twins cimport).
include "election.pxd"
