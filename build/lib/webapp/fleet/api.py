"""REST API of the fleet: the same overview the dashboard shows (no user data, any signed-in user)."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.fleet.selectors import fleet_overview, fleet_utilisation_series


class FleetOverviewApi(APIView):
    class Query(serializers.Serializer):
        window_s = serializers.FloatField(required=False, default=600.0, min_value=1.0, max_value=86400.0)

    @extend_schema(
        summary="Fleet hosts, live sandboxes, queue and utilisation history",
        parameters=[OpenApiParameter("window_s", float, description="seconds of utilisation history (1..86400)")],
        responses={200: dict},
    )
    def get(self, request):
        query = self.Query(data=request.query_params)
        if not query.is_valid():
            raise ValidationError(query.errors)
        window = query.validated_data["window_s"]
        return Response({"overview": fleet_overview(), "series": fleet_utilisation_series(window_s=window)})
