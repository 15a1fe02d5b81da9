# The compiled twin records_c is typed by records.pxd (the declarations other twins cimport).
include "records.pxd"
