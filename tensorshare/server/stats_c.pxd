# The compiled twin stats_c is typed by stats.pxd (the declarations other twins cimport).
include "stats.pxd"
