"""The census, module "vision" (one module per xdist worker's share): `census_models` holds the
families, `census_models.check` what is checked."""

import census_models

pytestmark = census_models.MARKS
test_census = census_models.census_test("vision")
