from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView


class MeSerializer(serializers.Serializer):
    username = serializers.CharField()
    teams = serializers.ListField(child=serializers.CharField())


class MeView(APIView):
    """The authenticated user, to check a token."""

    serializer_class = MeSerializer

    def get(self, request):
        data = {"username": request.user.username, "teams": list(request.user.teams.values_list("name", flat=True))}
        return Response(MeSerializer(data).data)
