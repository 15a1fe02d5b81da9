# The compiled twin fields_c is typed by fields.pxd (the declarations other twins cimport).
include "fields.pxd"
